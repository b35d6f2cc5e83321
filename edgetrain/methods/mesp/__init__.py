"""MeSP: hand-derived, memory-lean exact backward for LoRA fine-tuning of decoders (method `mesp`)."""
from edgetrain.methods.mesp.method import StructuredBackprop

__all__ = ["StructuredBackprop"]
