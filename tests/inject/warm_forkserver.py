"""Imported last by the tests' forkserver (tests/stall_matrix.py preload), the process every test job's ranks are
forked from: what each rank would otherwise do for itself in its first minute, done once before the forks.
- matplotlib's pyplot: the leader draws the reward curve at every checkpoint (infra/rundir.py; ~0.9 s of CPU to
  import);
- one load of the tiny FLUX pipeline, thrown away: a process's first load also imports diffusers' guiders and
  compiles transformers' loading patterns (~0.4 s of CPU per rank over a warm load's 0.2 s). Only when the
  pipeline is built already (otherwise the ranks build and load it, as before: nothing is built here). torch on
  one thread throughout, so this process never starts OpenMP's thread pool (a forked child cannot use its
  parent's); each rank sets its own --threads.
A rank runs the same code either way: this only fills what Python and the libraries cache per process.
"""
import os

import matplotlib

matplotlib.use("Agg")  # what infra/rundir.plot_reward_curves selects before its first figure
import matplotlib.pyplot  # noqa: E402,F401
import torch  # noqa: E402

import models  # noqa: E402
from models import pretrain  # noqa: E402


def _warm_load() -> None:
    name, variant = "flux", pretrain.variant_from_env()
    if variant == "full":
        return  # the shipped demo pipeline: not what the tests' jobs load
    path = models.tiny_pipeline_cache_path(name, variant)  # where the jobs' tiny_pipeline_path finds it
    if not os.path.isfile(os.path.join(path, "model_index.json")):
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models.load(name, path, "cpu", torch.float32)
    finally:
        torch.set_num_threads(threads)


_warm_load()
