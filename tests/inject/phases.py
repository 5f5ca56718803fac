"""The phase the calling thread is inside (infra/progress.py: a named phase, a trace span or an excused section),
for the test hooks that record blocking calls (comm_recorder.py) and inject faults (faults.py). `watch()` makes
every Progress created from then on findable; the project never imports this module.
"""
import functools
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests") + os.sep
HOOKS = os.path.dirname(os.path.abspath(__file__)) + os.sep  # this folder: the hooks' own frames are skipped
_SKIPPED = (threading.__file__, functools.__file__)
_progress: list = []  # the Progress objects of this process (a rank has one)


def watch() -> None:
    """Remember every infra.progress.Progress made from now on (once per process)."""
    from infra import progress as progress_lib
    cls = progress_lib.Progress
    if getattr(cls, "_phases_watched", False):
        return
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _progress.append(self)

    cls.__init__ = __init__
    cls._phases_watched = True


def progress():
    """This process's Progress (the last one made), or None."""
    return _progress[-1] if _progress else None


def stack(ident: int | None = None) -> list:
    """[(phase, since, idle)] of a thread (the calling one by default), innermost last."""
    p = progress()
    if p is None:
        return []
    return list(p.stacks.get(threading.get_ident() if ident is None else ident, ()))


def current() -> str | None:
    """The innermost phase of the calling thread, or None outside any."""
    entries = stack()
    return entries[-1][0] if entries else None


def project_caller() -> tuple[str, str] | None:
    """(file relative to the project, function) of the first frame outside the hooks (this folder) and the standard
    library's threading and functools when that frame is the project's own code (not tests/, not a library), else
    None."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith(HOOKS)
                                 or frame.f_code.co_filename in _SKIPPED):
        frame = frame.f_back
    if frame is None:
        return None
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(ROOT + os.sep) or path.startswith(TESTS) or "site-packages" in path:
        return None
    return os.path.relpath(path, ROOT), frame.f_code.co_qualname


C10D_OPS = ("send", "recv", "isend", "irecv", "broadcast", "all_reduce", "reduce", "all_gather",
            "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatter_single", "all_gather_object", "gather_object", "broadcast_object_list", "gather",
            "scatter", "barrier", "all_to_all_single", "batch_isend_irecv", "monitored_barrier")
FUNCOL_OPS = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_tensor",
              "reduce_scatter_tensor", "all_reduce_coalesced", "broadcast", "all_to_all_single")


def wrap_distributed(make) -> None:
    """Replace every torch.distributed entry point (C10D_OPS, FUNCOL_OPS) by make(module, name, current), also where
    a module imported before this bound it by name (DTensor's mesh_scatter: `from ... import scatter`)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.distributed_c10d as c10d

    replaced = {}  # id(the current function, or any it wraps) -> its replacement

    def layers(function):
        while function is not None:
            yield function
            function = getattr(function, "__wrapped__", None)

    for module, names, label in ((c10d, C10D_OPS, "dist"), (funcol, FUNCOL_OPS, "funcol")):
        for name in names:
            if hasattr(module, name):
                current = getattr(module, name)
                wrapped = make(label, name, current)
                replaced.update((id(f), wrapped) for f in layers(current))
                setattr(module, name, wrapped)
                if module is c10d:
                    setattr(dist, name, wrapped)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("torch.distributed") and module not in (c10d, dist, funcol):
            for attribute, value in list(vars(module).items()):
                if callable(value) and id(value) in replaced:
                    setattr(module, attribute, replaced[id(value)])
