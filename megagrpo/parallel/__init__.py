"""The parallel forward path's data layout: padded and packed micro-batches, the output layer's
loss positions, context and sequence parallelism, core attention.

Modules: attention, batch, context_parallel, positions, seqpar.
"""
