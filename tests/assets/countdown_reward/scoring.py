import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the equation uses each given number once and equals the target."""
    target, numbers = ground_truth["target"], ground_truth["numbers"]
    equation = solution_str.strip()
    if not re.fullmatch(r"[\d+\-*/() ]+", equation):
        return 0.0
    if sorted(int(n) for n in re.findall(r"\d+", equation)) != sorted(numbers):
        return 0.0
    return float(abs(eval(equation) - target) < 1e-6)
