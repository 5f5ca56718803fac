"""Test-only code injected into every process of a real run: tests put this folder (and the project root) on
PYTHONPATH, and Python imports `sitecustomize` at the start of every interpreter, the ranks that main.py
spawns included (and under torchrun). Nothing here runs in a normal run: the project never imports it.

- DIGENRL_COMM_LOG=<folder>: comm_recorder records every torch.distributed call (tests/test_comm_contract.py);
- DIGENRL_TEST_INJECT=<module>[,<module>...]: imports those modules of this folder, each of which patches the
  project in this process (e.g. fail_sender: the fragment sender's send raises; scripted_schedule: TAG and
  TCSS act at scripted moments, independent of timing; fake_hub: a Hub --pretrained without network).
"""
import importlib
import os

if os.environ.get("DIGENRL_COMM_LOG"):
    import comm_recorder  # noqa: F401

for _name in filter(None, os.environ.get("DIGENRL_TEST_INJECT", "").split(",")):
    importlib.import_module(_name.strip())
