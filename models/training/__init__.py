"""relserve.models.training: the shared resumable loop and the trainers of the default models."""
