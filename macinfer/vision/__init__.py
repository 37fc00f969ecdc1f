"""Images in: decoded and capped (`images`), expanded into the model's placeholder tokens
and pixel values by its own processor (`processor`), encoded to embedding rows by
mlx-vlm's vision tower and projector (`encoder`), carried per request (`inputs`).
May import mlx, mlx-vlm, transformers and `macinfer.text`; never the engine or server."""
