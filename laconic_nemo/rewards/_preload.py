"""Imported by the forkserver before it forks grading workers: pays the sympy / math-verify imports and the
lazy set-up of the comparison paths (numbers, expressions, intervals, sets, relations, matrices) once, so a
new or replacement worker starts warm in milliseconds."""

from .grader import answers_equivalent

_WARMUP = (
    ("\\frac{1}{2}", "0.5"),
    ("x^2+1", "1+x^2"),
    ("(1,2]", "[1,2)"),
    ("\\{1,2\\}", "1,2"),
    ("x=5", "5"),
    ("2\\sqrt{2}+\\pi", "\\sin(x)"),
    ("y=2x+1", "2x+1=y"),
    ("a \\le b", "b \\ge a"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "(1,2)"),
    ("10\\%", "0.1"),
    ("8.7\\times10^8", "870000000"),
    ("Eq(x**2 + y**2, 1)", "x^2+y^2=1"),
)
for _pred, _gold in _WARMUP:
    answers_equivalent(_pred, (_gold,))
