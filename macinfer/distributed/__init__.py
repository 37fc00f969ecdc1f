"""Running one model over several Macs: `mx.distributed` groups started by `mlx.launch`.

Every rank runs the same engine on its shard of the model (`sharding.py`): rank 0 takes
the requests and its step inputs (requests added, aborted) are broadcast to the other
ranks before each step (`group.py`), so every rank's scheduler, block tables, prefix cache
and preemptions stay identical without shipping them; rank 0 samples and broadcasts the
tokens (`LLMEngine` with a `DistContext`).
"""
