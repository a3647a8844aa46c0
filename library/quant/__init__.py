"""ConvRot INT8: Triton kernels, eager fallbacks, the int8 modules and the ComfyUI file format."""
