"""The process and device machinery under every other layer, importing nothing of the project:
torch.distributed and megatron's parallel state (``megatron_env``), the per-device kernel choices of the
megatron-core GPT (``kernels``), progress heartbeats and fault points (``faults``), the output-folder lock
(``run_lock``), a rank's death with its launcher (``parent_death``) and the stop signals (``stop_signals``).
"""
