"""Fine-tuning rows held in memory: labelled texts (classification.py), instruction pairs and conversations
(instructions.py, conversations.py, rendered by the checkpoint's chat template, chat.py), preference pairs
(preferences.py) and RL prompts (prompts.py); seq_lengths.py chooses their sequence length.

Tuning imports the corpora flow and the shared modules of jaxlm/data (files, tokenizer, packing), never the reverse.
"""
