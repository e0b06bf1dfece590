"""Speculative decoding: the proposers behind one interface, the rejection sampler and their configuration.

  speculator.py        the Speculator the engine core calls, over one Proposer interface (n-gram, draft model, MTP)
  spec_decode.py       SpecConfig, the counters and stats, n-gram proposals, MTP checks
  draft_model.py       a smaller draft model proposing tokens with its own KV cache
  mtp_proposer.py      the MTP head proposing tokens from the target's hidden state
  rejection_sampler.py greedy and random verification of drafted tokens
"""
