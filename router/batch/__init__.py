"""OpenAI's Files and Batch APIs on the fleet's spare capacity (issue 24).

`files`: uploaded files and batch results, their records in Redis and their bytes in a
blob store (`blobs`: a local directory, or a bucket). `batches`: batches and their lines'
state in Redis, claimed by replicas through leases; `runner`: what runs them.
"""
