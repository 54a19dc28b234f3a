"""The training toolkit shared by the drafter trainer (train/) and the embedded target's build
(embedded/): the learning-rate schedule and AdamW, orbax checkpoints with preemption, the JSONL /
TensorBoard log."""
