"""The shipped mesh layouts (one TOML file each), installed as the package data `jaxtrain.meshes`."""
