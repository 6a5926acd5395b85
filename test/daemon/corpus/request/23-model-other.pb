"
Jother
<3>stepd: x