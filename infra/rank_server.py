"""Imported first in the launcher's forkserver (infra/launch.py), the process the CPU ranks are forked from.

On CPU the launcher starts its ranks with multiprocessing's "forkserver": one fresh process imports torch,
diffusers and main.py once, and every rank is forked from it, instead of each rank importing them again
(about 4 s of CPU per rank, most of a short run's cost on a laptop or a 2-core CI machine). The forkserver is
the ranks' parent, so it must outlive them: a scheduler's SIGTERM to the whole process group must reach the
ranks (which stop after the step with a checkpoint, infra/preemption.py), not kill their parent first, which
would kill them at once (infra/lifeline.py). So the forkserver ignores SIGTERM; it exits when the launcher does
(multiprocessing closes its pipe), and SIGINT it already ignores. The ranks install their own handlers.
"""
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
