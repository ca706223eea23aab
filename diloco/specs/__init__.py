"""The shipped TrainSpecs (gpt: the byte-level GPT; hf: Hugging Face causal LMs) and how a spec is loaded;
a user's own model plugs in at the same seam (docs/SPEC.md)."""
