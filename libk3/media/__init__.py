"""Images in: from the bytes of an image file to the float32 pixel patches and the patch
grid the image tower consumes (formats/model/vision.md §4). Below the model: nothing here runs
the tower, and nothing here chooses where an image comes from (a file, a request)."""
