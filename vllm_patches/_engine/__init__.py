"""The engine that edits upstream code with the overlays: the hook kinds, the splice into
a source tree, the patch writer, the install into a live vLLM and its runtime activation,
and the fingerprints of the upstream code the fixes target."""
