"""Text as a target sees it: its tokenizer (tokenizer.json: load, save, train) and its chat
template (rendering in a sandbox, the assistant-answer loss mask)."""
