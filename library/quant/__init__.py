"""ConvRot INT8: Triton kernels and eager fallbacks (convrot_kernels), the int8 Linear as registered torch.library ops
(convrot_ops), the int8 modules and the ComfyUI file format (convrot)."""
