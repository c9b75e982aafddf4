"""What the tool knows: the series (fixes, covered releases, lanes), the committed
patches, vLLM's releases and the cache of fetched ones, the upstream sweep."""
