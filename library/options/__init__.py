"""Command-line options shared by the trainer, the inference script and the cache tools: each shared option group is
declared once (`groups`), what one option implies for another is applied in one place right after parsing
(`implications`), and the shared checks that belong to no single module only read the result (`checks`)."""
