"""Custom reward functions: a reward spec name `path/to/file.py:function` or `package.module:function`.

    python main.py --reward my_rewards.py:aesthetic=0.5,color=1

The function is called as fn(images, prompts) or, when it takes a third argument, fn(images, prompts, metadata)
(Flow-GRPO's form; metadata is one dict per sample, the dataset row of its prompt), with images float in [0, 1],
[B, 3, H, W] (or videos [B, F, 3, H, W]). It returns [B] scores or (scores, info) with info a dict of values to
log (rewards/checked.py); before any rank starts, one dry call on a 2-image batch checks what it returns. Files are imported by path (not through sys.path), so spawned rank
processes load them too, and each file runs once per process. Every failure (missing file or module,
import error, missing or non-callable attribute, wrong signature) is a ValueError naming the bad part
and the allowed forms, raised by `load_custom_reward` before any rank starts (rewards.check_reward_options).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable

CUSTOM_FORMS = "'path/to/file.py:function' or 'package.module:function'"
_loaded_files: dict[str, object] = {}  # absolute path -> module, so a file is executed once


def is_custom(name: str) -> bool:
    """A spec name with a colon names a custom reward function rather than a built-in one (remote:NAME is a
    remote reward, rewards/__init__.py)."""
    return ":" in name and not name.startswith("remote:")


def custom_metric_name(name: str) -> str:
    """How a custom reward is logged: the file's stem (or the module's last part) and the function, joined and
    cut to letters, digits and underscores: 'dir/my_rewards.py:aesthetic' -> 'my_rewards_aesthetic'. Never a
    path: slashes split W&B and TensorBoard groups, and moving the file would rename the metric."""
    target, attribute = split_custom(name)
    stem = os.path.splitext(os.path.basename(target))[0] if _is_file(target) else target.rpartition(".")[2]
    return re.sub(r"\W", "_", f"{stem}_{attribute}")


def split_custom(name: str) -> tuple[str, str]:
    """ "dir/my.py:score" -> ("dir/my.py", "score"); raise if either side is malformed."""
    target, _, attribute = name.rpartition(":")
    target, attribute = target.strip(), attribute.strip()
    if not target or not all(part.isidentifier() for part in attribute.split(".")):
        raise ValueError(f"bad custom reward {name!r}: give {CUSTOM_FORMS} "
                         f"(function a Python identifier)")
    return target, attribute


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _import_file(path: str, name: str):
    """Import a .py file by its path (not via sys.path, so spawned ranks load it too)."""
    full = os.path.abspath(path)
    if full in _loaded_files:
        return _loaded_files[full]
    if not os.path.isfile(full):
        where = "" if full == path else f" (looked at {full!r})"
        raise ValueError(f"custom reward {name!r}: file {path!r} does not exist{where}; "
                         f"give {CUSTOM_FORMS}")
    # A unique module name per path: two files called rewards.py must not replace each other.
    digest = hashlib.sha1(full.encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    module_name = f"_digenrl_reward_{stem}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, full)
    if spec is None or spec.loader is None:
        raise ValueError(f"custom reward {name!r}: {path!r} cannot be imported as Python "
                         f"(need a .py file); give {CUSTOM_FORMS}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # pickling and dataclasses look functions up here
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001  (any failure of user code is a bad value)
        sys.modules.pop(module_name, None)
        raise ValueError(f"custom reward {name!r}: importing {path!r} failed: "
                         f"{type(error).__name__}: {error}") from error
    _loaded_files[full] = module
    return module


def _import_module(module_name: str, name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if module_name == error.name or module_name.startswith(f"{error.name}."):  # it is missing
            path = module_name.replace(".", "/") + ".py"
            hint = (f"; there is a file {path!r}: use '{path}:{name.rpartition(':')[2]}'"
                    if os.path.isfile(path) else " (a file path must end in .py)")
            raise ValueError(f"custom reward {name!r}: no module {module_name!r} on sys.path; "
                             f"give {CUSTOM_FORMS}{hint}") from error
        raise ValueError(f"custom reward {name!r}: importing {module_name!r} failed: "
                         f"{type(error).__name__}: {error}") from error
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"custom reward {name!r}: importing {module_name!r} failed: "
                         f"{type(error).__name__}: {error}") from error


def load_custom_reward(name: str) -> Callable:
    """The callable a custom spec name points at ("file.py:fn" or "package.module:fn");
    raises ValueError naming the bad part and what is allowed."""
    target, attribute = split_custom(name)
    module = _import_file(target, name) if _is_file(target) else _import_module(target, name)
    fn = module
    for part in attribute.split("."):
        if not hasattr(fn, part):
            available = sorted(n for n, v in vars(module).items()
                               if callable(v) and not n.startswith("_") and not inspect.isclass(v)
                               and getattr(v, "__module__", None) == module.__name__)
            raise ValueError(f"custom reward {name!r}: {target!r} has no attribute "
                             f"{attribute!r}; functions defined there: {available}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"custom reward {name!r}: {attribute!r} in {target!r} is not callable "
                         f"(type {type(fn).__name__}); need a function fn(images, prompts) -> [B]")
    try:  # catch a wrong signature now rather than in every rank at the first reward
        signature = inspect.signature(fn)
    except ValueError:  # some builtins have no signature; the dry call (CombinedReward.probe) decides
        return fn
    for arity in (2, 3):
        try:
            signature.bind(*[None] * arity)
            return fn
        except TypeError:
            pass
    raise ValueError(f"custom reward {name!r}: {attribute}{signature} cannot be called as fn(images, prompts) "
                     "nor as fn(images, prompts, metadata)")
