"""Command-line options shared by the trainer, the inference script and the cache tools: each shared option group is
declared once (`groups`), and what one option implies for another is applied in one place (`implications`)."""
