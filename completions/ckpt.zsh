
#compdef ckpt

_ckpt_completion() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _CKPT_COMPLETE=complete_zsh ckpt)
}

compdef _ckpt_completion ckpt

