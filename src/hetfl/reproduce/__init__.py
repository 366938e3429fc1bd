"""Paper reproductions: each module builds its paper's grid of configs and writes a results file."""
