"""Running `mmenc encode`: `pipeline.run_encode(cfg)` and the stages it wires.

Modules, in the order an item meets them: `pipeline.py` (the run and its row loop), `stages.py`
(the feeds and the encode stage), `media.py` with `decode_pool.py`, `decode_worker.py` and
`shm.py` (image, audio and video items, decoded in worker processes, image pixels back through
shared memory), `texts.py` (text windows),
`stage.py` (micro-batches through the encoder), `commit.py` (shards written on a background
thread), `failures.py` (error rows); around them `counters.py`, `resume.py`, `metadata.py`, and
`devices.py` (one process per device). Nothing is imported here, so the decode workers, which
import `decode_worker`, stay light.
"""
