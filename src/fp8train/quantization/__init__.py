"""How each recipe quantizes a linear layer: one file per recipe family, registered in recipe.py."""
