"""The trainer's parts, one job each (``mhar_titan.train.Trainer`` wires them together).

===============  ==================================================================
``batches``      batch geometry (global batch, gradient accumulation), micro-batches
``loss``         summed token cross-entropy and the ignored label
``run_folder``   lock, fresh-start refusal, metrics truncation, resolved config
``train_state``  the trainer's counters (checkpointed) and the health guard
``performance``  per-step throughput and MFU, profiler traces, CUDA memory snapshots
===============  ==================================================================
"""
