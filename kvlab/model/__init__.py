"""The model: loading it, what it allows (context, EOS ids), and the hook that runs it on kvlab's caches."""
