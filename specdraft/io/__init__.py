"""What both halves read: the target (load, dtype, features), prompts and training conversations, hardware facts."""
