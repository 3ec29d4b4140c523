"""The trainer's parts, one job each (``mhar_titan.train.Trainer`` wires them together).

===============  ==================================================================
``batches``      batch geometry (global batch, gradient accumulation), micro-batches
``loss``         summed token cross-entropy (plus the optional z-loss) and the ignored label
``ema``          weight EMA of the parameters (checkpointed; validation and export use it)
``run_folder``   lock, fresh-start refusal, metrics truncation, resolved config
``train_state``  the trainer's counters (checkpointed) and the health guard
``performance``  the start-up line, per-step throughput and MFU, profiler traces, CUDA memory snapshots
``ranks``        seeds of the global RNGs; all ranks stop together on a start-up or data error
===============  ==================================================================
"""
