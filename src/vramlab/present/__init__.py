"""How the course shows what `vramlab` computes: the calculators' declarations (`calculators`, pure,
shipped to the browser with `svg`), their ipywidgets front end (`widgets`, with `show` for a book
cell), matplotlib figures (`plots`) and the command line (`cli`). Nothing here measures; nothing
below imports anything here. Importing this package imports neither ipywidgets nor matplotlib."""
