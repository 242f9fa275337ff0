"""The GSPO math, pure tensor functions without Megatron: the losses (GSPO and its lineage),
advantages from rewards, token log-probs from vocabulary-parallel logits, and packing
sequences into minibatches and microbatches."""
