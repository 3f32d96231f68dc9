"""What kvlab is measured against: transformers' own generate and beam search, and static batching."""
