"""The Qwen3.5 text encoder of MOSS-Image, in one package.

- `loading`: the one loader of a run (`load_text_encoder`: dtype rule, placement, quantisation, cache variant) and the
  prediction of its cache variant before anything is read;
- `encoding`: the one encoding entry point (`encode_captions`), padding for the DiT, deferred encoders;
- `qwen35`: the checkpoint layouts, the config, the weights reader, the tokenizer and the prompt template;
- `quant`: ConvRot INT8 and `--te_quant` (bitsandbytes) for the text encoder, `--te_device`;
- `variant`: the cache variant names; `base_weights`: the identity of `--base_weights` in the text encoder.
"""
