# nbgrader course directory: run `nbgrader generate_assignment LAB` / `nbgrader autograde LAB` from labs/
# after `python tools.py sources` (nbgrader reads .ipynb sources; ours are MyST .md).
c = get_config()  # noqa: F821
c.CourseDirectory.root = "."
c.CourseDirectory.course_id = "vramlab"
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.db_url = "sqlite:///gradebook.db"
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.Execute.timeout = 600
