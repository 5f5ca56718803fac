"""Shared pytest setup: make the flat project modules (rewards.py, grpo.py, ...) importable
when pytest is run as plain `pytest` from any directory, not only `python -m pytest`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
