"""brigade's DeepSpeed engine: one strategy module per DeepSpeed mechanism (ZeRO, pipeline, MoE) and
the generated DeepSpeed config."""
