"""Models: a small zoo of deterministic ``nn.Sequential`` models (see ``flotilla.models.zoo``)."""

from flotilla.models.zoo import MODELS, build_model, count_parameters

__all__ = ["MODELS", "build_model", "count_parameters"]
