"""Text shipped with rtrl: the corpus the tiny model's tokenizer is trained on (`services/tinymodel.py`)."""
