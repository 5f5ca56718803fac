"""Injected into a real run (tests/inject/sitecustomize.py): the first fragment the sender thread sends raises,
as a send to a trainer whose connection was reset would (tests/test_failure_paths.py)."""
import transport



def _failing_send(fragment, dst, group=None):
    raise ConnectionResetError(f"injected: the connection to rank {dst} was reset (fragment of step "
                               f"{fragment.step}, groups from {fragment.first_group})")


transport.send_fragment = _failing_send
