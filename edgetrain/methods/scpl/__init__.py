"""SCPL (supervised contrastive parallel learning) and the Early Exit baseline: local objectives per
component, gradients never crossing a component boundary. Importing this package registers the
methods `scpl` and `early_exit`; the pipelined multi-process runner is edgetrain.recipes.scpl_pipeline."""
from edgetrain.methods.scpl.augment import AugmentConfig, augment_images, make_views
from edgetrain.methods.scpl.components import (Component, build_components, describe_components, model_units,
                                               remove_local_heads, split_counts)
from edgetrain.methods.scpl.method import SCPL, EarlyExit, LocalLearning, model_image_shape
from edgetrain.methods.scpl.supcon import DEFAULT_TEMPERATURE, supcon_loss

__all__ = ["AugmentConfig", "Component", "DEFAULT_TEMPERATURE", "EarlyExit", "LocalLearning", "SCPL",
           "augment_images", "build_components", "describe_components", "make_views", "model_image_shape",
           "model_units", "remove_local_heads", "split_counts", "supcon_loss"]
