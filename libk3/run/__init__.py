"""What one k3-run invocation does: budgets and admission, the run shapes (one prompt, a
batch file, a chat), batch files and their results, prompt files, the run report, the
chat's console (``repl``)."""
