"""How the course shows what `vramlab` computes: the calculators' declarations (by chapter in `calc_*`,
registered in `calculators`; pure, shipped to the browser with `svg`), their ipywidgets front end
(`widgets`, with `show` for a book cell), matplotlib figures (`plots`) and the command line (`cli` and
its `cli_*`). Nothing here measures; nothing below imports anything here. Importing this package imports
neither ipywidgets nor matplotlib."""
