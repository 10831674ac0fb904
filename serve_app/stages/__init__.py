"""The pipeline's stages: preprocess (decode), inference (batcher + engine), postprocess."""
