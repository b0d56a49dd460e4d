"""The built-in ChatML prompt template and the local tokenizer: how rollgate itself turns
messages into prompt ids, shared by the worker (SGLang's /generate path, an `openai` upstream
with a tokenizer) and `rollgate check-upstream`. Imports nothing of ours (STYLE.md)."""
