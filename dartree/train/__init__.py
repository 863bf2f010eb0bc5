"""Self-distillation training of the drafter and its correction heads (``dartree train``)."""
