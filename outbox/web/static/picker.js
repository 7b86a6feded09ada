// The target picker in the header: choosing a target opens it (the button stays for
// browsers without scripts). Loaded only when the dashboard shows several targets.
document.addEventListener("change", (event) => {
  const select = event.target;
  if (select instanceof HTMLSelectElement && select.form && select.form.matches("form.picker")) {
    select.form.requestSubmit();
  }
});
