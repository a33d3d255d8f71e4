#include "common/command_line.h"

#include <CLI/CLI.hpp>

namespace sparseps {
namespace {

void Apply(CLI::Option* option, unsigned checks) {
  if (checks & CommandLine::kRequired) option->required();
  if (checks & CommandLine::kExistingFile) option->check(CLI::ExistingFile);
}

}  // namespace

CommandLine::CommandLine(const std::string& description, const std::string& name)
    : app_(std::make_unique<CLI::App>(description, name)) {}

CommandLine::~CommandLine() = default;

void CommandLine::Footer(const std::string& text) { app_->footer(text); }

void CommandLine::Version(const std::string& text) { app_->set_version_flag("--version", text); }

void CommandLine::Option(const std::string& names, std::string* value, const std::string& help,
                         unsigned checks) {
  Apply(app_->add_option(names, *value, help), checks);
}

void CommandLine::Option(const std::string& names, int64_t* value, const std::string& help,
                         unsigned checks) {
  Apply(app_->add_option(names, *value, help), checks);
}

void CommandLine::Option(const std::string& names, std::vector<std::string>* values,
                         const std::string& help, unsigned checks) {
  Apply(app_->add_option(names, *values, help)->take_all(), checks);
}

void CommandLine::Flag(const std::string& names, bool* value, const std::string& help) {
  app_->add_flag(names, *value, help);
}

int CommandLine::Parse(int argc, const char* const* argv) {
  try {
    app_->parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app_->exit(e) == 0 ? 0 : 2;
  }
  return -1;
}

}  // namespace sparseps
