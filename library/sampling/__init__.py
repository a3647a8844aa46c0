"""The official sampler, prompt files and the image-generation glue shared by training and inference."""
