"""Injected into a real run (tests/inject/sitecustomize.py, DIGENRL_TEST_INJECT=fake_hub): the Hugging Face Hub,
without a network, for --pretrained digenrl-test/<name> (tests/test_multinode.py).

models.hub_download is replaced by a download of the tiny FLUX pipeline into the process's Hugging Face cache
($HF_HUB_CACHE/models--digenrl-test--<name>/, the cache's own layout: the snapshot is complete once refs/main is
written), one file at a time over DIGENRL_TEST_FAKE_HUB_SECONDS, so a waiting rank sees the bytes grow. Every
download (not the cache look-ups of local_only) appends "<node> <local rank> <repo id>" to
DIGENRL_TEST_FAKE_HUB_CALLS. With DIGENRL_TEST_FAKE_HUB_FAIL set, a download fetches half the files, then fails as
an unavailable Hub does.
"""
import os
import shutil
import time

COMMIT = "0" * 40


def _download(name: str, repo_id: str, local_only: bool) -> str:
    from huggingface_hub import constants

    root = os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(root, "snapshots", COMMIT)
    if local_only:
        if os.path.isfile(os.path.join(root, "refs", "main")):
            return snapshot
        raise OSError(f"{repo_id} is not in the cache and outgoing traffic has been disabled")
    with open(os.environ["DIGENRL_TEST_FAKE_HUB_CALLS"], "a") as f:
        f.write(f"{os.environ.get('GROUP_RANK', '-')} {os.environ.get('LOCAL_RANK', '-')} {repo_id}\n")
    import models

    source = models.tiny_pipeline_path("flux")
    files = sorted(os.path.relpath(os.path.join(d, n), source) for d, _, names in os.walk(source) for n in names)
    pause = float(os.environ.get("DIGENRL_TEST_FAKE_HUB_SECONDS", "0")) / len(files)
    fail = bool(os.environ.get("DIGENRL_TEST_FAKE_HUB_FAIL"))
    for i, name in enumerate(files):
        if fail and i == len(files) // 2:
            raise OSError(f"503 Server Error: Service Unavailable for url: https://huggingface.co/api/models/{repo_id}"
                          " (injected)")
        os.makedirs(os.path.dirname(os.path.join(snapshot, name)), exist_ok=True)
        shutil.copyfile(os.path.join(source, name), os.path.join(snapshot, name))
        time.sleep(pause)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(COMMIT)
    return snapshot


if "RANK" in os.environ:  # a rank (torchrun's agent imports this file too, and needs no models)
    import models

    models.hub_download = _download
