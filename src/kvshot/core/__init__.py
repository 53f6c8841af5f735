"""Plain utilities every stage uses: atomic files, progress lines, integrity manifests, the GGUF reader, the tap-layer convention, learning-rate schedules."""
