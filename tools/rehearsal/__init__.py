"""The rehearsal of a real run on a CPU (tools/rehearse.py): a stand-in GPU, the process groups that
replace NCCL and gloo, memory accounting and the time model. Nothing here runs in a real job."""
